"""``python -m components.kuberay [OUT_DIR] [--check]``: regenerate (or check) the committed manifests."""

import sys

from components.kuberay.render import main

sys.exit(main())
