"""Every kind of target has its Backend, found from the scheme of ``target.url``; a kind without one is one clear
error, never another kind's behaviour."""

from __future__ import annotations

import pytest

from applier.targets.backends import backend
from applier.url import SCHEMES, Kind, kind_of


@pytest.mark.parametrize("kind", list(Kind))
def test_every_kind_has_its_backend(kind: Kind) -> None:
    assert backend(kind).kind is kind


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_every_scheme_names_a_kind_with_a_backend(scheme: str) -> None:
    kind = kind_of(f"{scheme}:///replica")
    assert kind is SCHEMES[scheme] and backend(kind).kind is kind


def test_an_unknown_kind_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="'mysql'"):
        kind_of("mysql://h/db")
    with pytest.raises(ValueError, match="duckdb"):
        backend("duckdb")  # type: ignore[arg-type]
