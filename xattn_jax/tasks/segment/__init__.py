"""Promptable segmentation of composed digits with a Segment-Anything-shaped model (two-way attention)."""
