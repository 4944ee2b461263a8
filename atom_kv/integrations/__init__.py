"""Adapters that let real engines load atom-kv by name; each imports its engine lazily."""
