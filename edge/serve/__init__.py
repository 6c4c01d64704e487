"""`edge-agent serve`: the OpenAI-compatible endpoint, its chat page and its statistics."""
