"""The trace store: its format (schema.py), reading it (reader.py, parquetfile.py, legacy.py for format 1),
writing it (writer.py under lock.py, atomic files.py; meta.json sealed by meta.py), migrating and
verifying it, and the runs/ layout (layout.py).

May import: data.errors, data.stats, data.versions. Imported by every other room (docs/store.md).
"""
