# The Triton hook tests run the MoE kernels under Triton's interpreter on CPU machines; the
# kernel tests' conftest patches two gaps of that interpreter when it is imported.
import tests.kernels.conftest  # noqa: F401
