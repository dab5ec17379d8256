"""Model presets: the TOML files beside this one (data only)."""
