"""Plugins written the way upstream slime's current examples are (search-r1, multi_agent, retool at THUDM/slime
624b824): they call `Sample.append_response_tokens`, return several samples (or none) from a generate function,
score with `rm_hub.math_dapo_utils` and are routed per sample by a `--data-source-path` class."""
