"""``python -m agentx.kernels.cpu``: build the compiled CPU kernels now (``make`` runs it)."""

from agentx.kernels.cpu.build import main

main()
