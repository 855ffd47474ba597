"""Process groups: the default one from any launcher, every group of the topology, the mpu."""
