"""The fact families: one module per family, each computing the facts the catalogue (trace/catalog.py) names it
the producer of, and declaring them as PRODUCES."""
