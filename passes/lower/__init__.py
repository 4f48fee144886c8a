"""Passes on each graph AOTAutograd hands on: share outlined bodies, split grouped markers, lower the
markers to functional collectives and bucket them per unit."""
