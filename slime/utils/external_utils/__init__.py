"""Helpers for scripts that launch slime (upstream's `slime.utils.external_utils`); slime itself never imports them."""
