"""The training program: `python -m train.train` on every rank, with the directory holding this package
(/workspace in the image, /data/code after `fab sync`) on PYTHONPATH."""
