"""Inference engines behind the router: server command lines, process lifecycle and the HTTP control client."""
