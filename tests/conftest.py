# tests/data holds inner suites that tests run in a subprocess; never collect them directly
collect_ignore_glob = ["data/*"]
