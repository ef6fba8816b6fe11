"""The router: the OpenAI-compatible front end, and the messages it speaks with workers."""
