"""The disk tier's mechanism: the slot file, its recovery at start, the data folder."""
