"""The one exception type the library raises for problems a user can act on."""


class MacMoesdError(Exception):
    """A runtime failure with a message fit to show as is (the CLI exits 1 with it)."""


class BadInput(MacMoesdError):
    """Input the user gave is out of range or inconsistent (the CLI exits 2 with it)."""
