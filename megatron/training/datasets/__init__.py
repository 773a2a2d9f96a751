"""Application glue of the data path: samplers/data loaders and the dataset provider."""
