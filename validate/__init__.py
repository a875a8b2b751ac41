"""Run real DeepSpeed jobs and hold zerocalc's formulas to them."""
