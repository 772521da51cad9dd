"""``python -m mergescope.analysis [--experiment toy] [--root .]``: the study's report from MLflow alone."""

import sys

from mergescope.analysis.task import main

sys.exit(main())
