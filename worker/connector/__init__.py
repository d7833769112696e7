"""The KV connector: the interface the scheduler and engine see of a KV tier, with its lookups
and layer-wise loads off the engine's thread."""
