"""The shipped scenario files (``*.yaml``): package data, found by `kvharbor.scenario.catalog`."""
