"""The leaves every layer may use: the user-error type and exit codes, dtypes, the GPU table, storage on
any fsspec URL, and loading a user's own function. Nothing here imports another disttrain package."""
