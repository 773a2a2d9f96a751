"""Datasets: the .bin/.idx indexed format, GPTDataset, blending and the split builder."""
