"""What differs between the Ultralytics releases of the tested window (inputs/ultralytics_files.py), each named with
the releases it applies to. The other modules of this package ask here; no other package learns about versions.

A release that is not a plain one (a development build) is taken as the newest of the window. The launcher reads what
it needs of Ultralytics from the installed files (inputs/ultralytics_files.py: check_cfg's tables and its rule for
integral floats, which takes them from 8.4.172), so it follows the release without a number.
"""

from __future__ import annotations

from ultralytics import __version__

from launcher.inputs.ultralytics_files import NEWEST_VERSION, release

INSTALLED = release(__version__) or release(NEWEST_VERSION)

# strip_optimizer clears the early stopper's state ("stopper") with the optimizer's from 8.4.172; before, it leaves it.
STRIP_CLEARS_STOPPER = INSTALLED >= (8, 4, 172)

# ConfusionMatrix.process_batch from 8.4.184 visits the detections in descending confidence, each claiming its best
# unclaimed target (the rule rank/validate/confusion.py counts on the device); before, it keeps the pairs of highest
# IoU, one per target and one per detection: there the fast validator calls process_batch itself, image by image.
GREEDY_CONFUSION = INSTALLED >= (8, 4, 184)

# BaseValidator.match_predictions from 8.4.176 visits the detections in descending confidence, each claiming its best
# unclaimed target at each threshold (the rule rank/validate/matching.py runs over whole batches); before, it keeps the
# pairs of highest IoU per threshold: there the fast validator calls match_predictions itself, image by image.
GREEDY_MATCHING = INSTALLED >= (8, 4, 176)
