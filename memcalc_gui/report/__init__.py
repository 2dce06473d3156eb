"""memcalc_gui.report"""
