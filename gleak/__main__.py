from gleak.cli import entry

entry()
