"""vlmdoctor: profiler-driven diagnosis of vision-language-model training."""
__version__ = "0.1.0"

#: version of the report JSON layout; bump when a field changes meaning or moves
SCHEMA_VERSION = 1
