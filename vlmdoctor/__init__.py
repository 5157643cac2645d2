"""vlmdoctor: profiler-driven diagnosis of vision-language-model training."""

__version__ = "0.1.0"

#: version of the report JSON layout; bump when a field changes meaning or moves
SCHEMA_VERSION = 1


def __getattr__(name: str):
    """`vlmdoctor.Doctor` and `vlmdoctor.DoctorCallback`, imported on first use (torch and transformers are heavy)."""
    if name == "Doctor":
        from vlmdoctor.api import Doctor

        return Doctor
    if name == "DoctorCallback":
        from vlmdoctor.callback import DoctorCallback

        return DoctorCallback
    raise AttributeError(f"module 'vlmdoctor' has no attribute {name!r}")
