"""FX passes: one per file, each docstring draws the graph before and after."""
