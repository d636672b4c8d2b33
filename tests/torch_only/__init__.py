"""The tests that need only torch (their conftest says how they run); a package, so that its conftest is not
the suite's ``conftest`` the host tests import from."""
