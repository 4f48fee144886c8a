"""Passes on each graph AOTAutograd hands on: share outlined bodies, and lower every marker to its bucket's
functional collectives (NOTE [one lowering] in ``markers.py``; ``bucket.py`` writes them)."""
