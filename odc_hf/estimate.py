"""``python -m odc_hf.estimate``: will ODC pay off on your data? Predicted step times before you rent GPUs.

The command's home is :mod:`odc_hf.prediction.estimate_cli` (``--help`` says it all); this module keeps the
documented command name short.
"""

from odc_hf.prediction.estimate_cli import main

if __name__ == "__main__":
    main()
