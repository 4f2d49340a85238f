"""What the user asked for: the config schema, key=value overrides, the checks and the ordered rule list that
resolve a config on a world size into a ResolvedRun."""
