"""Data: TFDS builders (``builders``), batches (``pipeline``), tokenizers. The names are here so that a config can
be checked without importing TFDS or grain, which load only when a run reads data."""

DATASET_NAMES = ("tiny_shakespeare", "text_file")  # the builders of qkvjax.data.builders.DATASETS
SPLITS = ("train", "validation", "test")
SAMPLINGS = ("disjoint", "random")  # how training windows are drawn (qkvjax.data.pipeline.train_batches)
