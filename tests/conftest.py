pytest_plugins = ["tests.plugins.clusters"]
