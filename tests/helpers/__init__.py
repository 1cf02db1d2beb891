"""Helpers shared by the tests of several folders (never imported from another test module)."""
