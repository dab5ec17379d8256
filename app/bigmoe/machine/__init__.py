"""Where things live on this machine: GPUs, RAM, disks, and the measured speeds of the links between them."""
