"""Test set-up: 8 emulated CPU devices and float64, before JAX starts its backend."""

import jax

import jaxdp

jaxdp.emulate_cpu_devices(8)
jax.config.update("jax_enable_x64", True)
