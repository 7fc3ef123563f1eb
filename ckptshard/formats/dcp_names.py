"""The names of a DCP folder's files, apart from the modules that read and write them.

Kept import-free so that recognising a DCP folder (``sources/probe``) does
not import DCP's readers on every run.
"""

METADATA = ".metadata"  # the file of a DCP folder that describes it
