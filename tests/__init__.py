"""The test tree is a package so that helpers are imported by one name:
`tests.support.*` (test helpers), `tests.fixtures.*` (pytest plugins)."""
