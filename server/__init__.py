"""OpenAI-compatible HTTP front end and the specserve command line."""
