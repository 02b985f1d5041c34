"""The shipped example: modelled profiles, layer profiles and a network file, as package data. See docs/search.md."""
