"""The one resolved Layout (how a run is cut over ranks) and its rule families, each returning `Problem`s.
Pure Python: no torch."""
