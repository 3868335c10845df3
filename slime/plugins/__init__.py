"""Optional add-ons that slime's layers never import: they are loaded by dotted path (`--spec`, `--*-path`).

Upstream slime ships these as a top-level `slime_plugins` package. Here they live inside slime, so a user's own
`slime_plugins` package on PYTHONPATH is never shadowed by ours; upstream's dotted paths into it
(`slime_plugins.models.glm4`) still load ours when the user's import of that path fails (`load_function`).
"""
