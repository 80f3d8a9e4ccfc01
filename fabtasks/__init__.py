"""The fab tasks beyond fabfile.py's own: see fabfile.py for the collection."""
