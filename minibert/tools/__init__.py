"""Chapter 7 and beyond: the planner, checkpoint resharding, HuggingFace conversion and fill-mask."""
