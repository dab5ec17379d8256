"""The model: presets, its checkpoint on disk (fetched, made or given) and the numbers read from it."""
