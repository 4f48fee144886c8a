"""Passes on each graph AOTAutograd hands on: share outlined bodies, lower or split flat markers, lower the
markers to functional collectives and bucket them per unit."""
