"""Test and bench scaffolding (fake engines, cluster harness, helpers); never used by the product."""
