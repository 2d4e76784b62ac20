def pytest_configure(config):
    # CI runs every test; `slow` only labels those that need the bundled model (select with -m slow / -m "not slow").
    config.addinivalue_line("markers", "slow: needs the real bundled model (minutes on a 2-core CPU)")
