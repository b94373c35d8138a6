"""The lab: probes and research benchmarks (GPU measurements behind benchmarks/RESULTS.md; their
history in lab/LOG.md). The lab may import the product (model, srelu24_kernels, data, training, scripts);
the product never imports the lab. Each module imports on a CPU machine; its GPU work runs only
under `if __name__ == "__main__"`."""
