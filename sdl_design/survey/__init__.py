"""The survey statistics under every stage: the design and its estimators (Taylor and
replicate variance, quantiles), survey-weighted GLMs, calibration, and the block and exact
sums that make a sum the same bits however the records are split."""
