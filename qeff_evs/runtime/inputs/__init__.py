"""Inputs: video files and arrays, preprocessing to patches, synthetic clips, prompt pieces."""
